"""DeepSpeed: a whole ``DeepSpeedEngine`` (any ZeRO stage) checkpointed through `resumable`.

Put ``DeepSpeedState(engine)`` in the `Checkpointer`'s state in place of the model and
optimizer, and drop ``engine.save_checkpoint`` and ``load_checkpoint``::

    ckpt = resumable.Checkpointer("runs/exp", {"engine": DeepSpeedState(engine)})

Contract: what is saved is what ``engine.save_checkpoint`` writes, kept in memory, and a
restore replays ``engine.load_checkpoint``: the engine continues bit-identically. Nothing
is unpickled; a tree that fails its checks is a `CorruptCheckpointError`. The trade-off:
a ZeRO partition is per-rank state, so a checkpoint restores only at the world size that
wrote it (`StateMismatchError`). `export_deepspeed` writes DeepSpeed's layout, which its
``ds_to_universal`` reshards. Pipeline parallelism, mixture of experts, NVMe offload,
curriculum learning and random-LTD raise `UnsupportedStateError`. How to start the
processes under ``torchrun --max-restarts``, and why: docs/deepspeed.md.
"""

from __future__ import annotations

import enum
import math
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StateMismatchError,
    UnsupportedStateError,
)

__all__ = ["DeepSpeedState", "export_deepspeed", "state_sha256"]

FORMAT = 1
"""Version of the tree `DeepSpeedState.state_dict` returns."""

_VIRTUAL = "/resumable-deepspeed"
"""The directory DeepSpeed's save code is told it writes into. Nothing is written there:
the engine's ``checkpoint_engine`` is swapped for one that keeps the dicts in memory, and
only the file names relative to it are kept."""
_TAG = "tag"

TAG_KEY = "__deepspeed__"
"""Key of a tagged node: a DeepSpeed object written as plain values."""

_SCALERS: dict[str, Any] = {
    c.__name__: c
    for c in (
        getattr(ds_loss_scaler, "LossScaler", None),
        getattr(ds_loss_scaler, "DynamicLossScaler", None),
    )
    if isinstance(c, type)
}
_ENUMS: dict[str, type[enum.Enum]] = {"ZeroStageEnum": ZeroStageEnum}
_PLAIN_ATTRS = (bool, int, float, str, type(None), torch.dtype)

# The attributes a loss scaler may be rebuilt with, each with its type and range
# (`_check_value`), and the value an older tree without it gets (None: required). What
# DeepSpeed 0.19's ``LossScaler``/``DynamicLossScaler.__init__`` set, and no more: an
# entry can never replace a method or set anything else.
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_COMMON_ATTRS: dict[str, tuple[type, float | None, float | None, Any]] = {
    "cur_scale": (float, 0.0, None, None),
    "dynamic": (bool, None, None, None),
}
_SCALER_ATTRS: dict[str, dict[str, tuple[type, float | None, float | None, Any]]] = {
    "LossScaler": dict(_COMMON_ATTRS),
    "DynamicLossScaler": {
        **_COMMON_ATTRS,
        "cur_iter": (int, 0, 2**63 - 1, None),
        "last_overflow_iter": (int, -1, 2**63 - 1, None),
        "scale_factor": (float, 0.0, None, None),
        "scale_window": (int, 1, 2**63 - 1, None),
        "min_scale": (float, 0.0, None, None),
        "delayed_shift": (int, 1, 2**63 - 1, None),
        "cur_hysteresis": (int, 0, 2**63 - 1, None),
        "consecutive_hysteresis": (bool, None, None, None),
        "raise_error_at_min_scale": (bool, None, None, True),
        "dtype": (torch.dtype, None, None, torch.float16),
    },
}


class _MemoryEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that keeps what it is given, by file name."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, Any] = {}

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        self.files[os.path.relpath(path, _VIRTUAL)] = state_dict

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass

    def load(self, path: str, map_location: Any = None) -> Any:
        raise CheckpointError("DeepSpeedState does not load through a checkpoint engine")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True


def _check_supported(engine: Any) -> None:
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise UnsupportedStateError(
            f"DeepSpeedState takes the engine deepspeed.initialize returned, found "
            f"{type(engine).__name__}"
        )
    unsupported = [
        ("pipeline parallelism", isinstance(engine, deepspeed.PipelineEngine)),
        ("mixture of experts", bool(getattr(engine, "has_moe_layers", False))),
        ("NVMe optimizer offload", bool(engine.zero_nvme_offload_optimizer())),
        ("curriculum learning", bool(engine.curriculum_learning_enabled())),
        ("random-LTD", bool(engine.random_ltd_enabled())),
    ]
    names = [name for name, on in unsupported if on]
    if names:
        raise UnsupportedStateError(
            f"DeepSpeedState does not support {', '.join(names)} yet (their state lives in "
            "further files of DeepSpeed's layout); use engine.save_checkpoint for this job"
        )


def _dp_rank_and_world(engine: Any) -> tuple[int, int]:
    group = getattr(engine.optimizer, "dp_process_group", None)
    if not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


class DeepSpeedState:
    """The whole training state of a DeepSpeed engine, as one entry of a `Checkpointer`.

    Args:
        engine: what ``deepspeed.initialize`` returned first (a ``DeepSpeedEngine``), with
            any ZeRO stage (0-3), fp32, fp16 or bf16, and CPU optimizer offload.
    """

    resumable_per_rank = True
    """Each rank holds its own ZeRO partition (`resumable.pipeline.restorer`)."""

    resumable_world_size_hint = (
        "a DeepSpeed engine's ZeRO partitions restore at the world size that saved them. "
        "To change it, write DeepSpeed's layout with "
        "resumable.integrations.deepspeed.export_deepspeed, convert it with DeepSpeed's "
        "ds_to_universal and load it with engine.load_checkpoint and "
        '"checkpoint": {"load_universal": true}, then save with resumable again'
    )
    """Why `Checkpointer.restore` refuses a world-size change even when asked to reset
    per-rank state (that would silently start this engine afresh)."""

    resumable_copies_on_load = True
    """`load_state_dict` keeps no tensor it is given (`_Borrowed`): a restore hands it
    the values as read (views of a mapped file or a shared-memory slot), DeepSpeed
    copies most of them into the engine, and what the engine kept after the load (the
    optimizer's moments, kept by reference by ``torch.optim.Optimizer.load_state_dict``)
    is copied into the tensors that held them before, or cloned: one copy each, where
    a copy made before the call would have been a second (`resumable._restore`)."""

    def __init__(self, engine: Any) -> None:
        _check_supported(engine)
        self.engine = engine

    @property
    def resumable_replicated(self) -> tuple[tuple[str, ...], ...]:
        """Where in `state_dict` every rank holds the same tensors, written once per job
        (as DeepSpeed writes its model states from data-parallel rank 0 only): the module
        of ZeRO stages 0 to 2, whose parameters every data-parallel rank holds whole,
        where the data-parallel group is the whole job. Stage 3 partitions them, and
        model-parallel ranks hold different ones: per rank there."""
        engine = self.engine
        if int(engine.zero_optimization_stage()) >= 3 or not torch.distributed.is_initialized():
            return ()
        if _dp_rank_and_world(engine)[1] != torch.distributed.get_world_size():
            return ()
        return (("model_states", "module"),)

    # ------------------------------------------------------------------- save

    def state_dict(self) -> dict[str, Any]:
        """What ``engine.save_checkpoint`` would write on this rank, as plain values and
        live tensors (the `Checkpointer` copies them before training goes on)."""
        engine = self.engine
        mem = _MemoryEngine()
        saved_engine, saved_flag = engine.checkpoint_engine, engine.save_non_zero_checkpoint
        engine.checkpoint_engine = mem
        # Every rank keeps the model-states dict (DeepSpeed writes it from data-parallel
        # rank 0 only; here each rank's tree must restore on its own).
        engine.save_non_zero_checkpoint = True
        try:
            if engine._optimizer_has_ckpt_event_prologue():
                engine.optimizer.checkpoint_event_prologue()
            engine._save_checkpoint(_VIRTUAL, _TAG)
            zero = None
            if engine.save_zero_checkpoint:
                # What _save_zero_checkpoint builds, without the recovery script it copies.
                zero = {
                    "optimizer_state_dict": engine.optimizer.state_dict(),
                    "ds_config": engine.config,
                    "ds_version": deepspeed.__version__,
                }
                mem.save(zero, engine._get_zero_ckpt_name(_VIRTUAL, _TAG))
            if engine._optimizer_has_ckpt_event_epilogue():
                engine.optimizer.checkpoint_event_epilogue()
        finally:
            engine.checkpoint_engine = saved_engine
            engine.save_non_zero_checkpoint = saved_flag
        model_name = os.path.relpath(engine._get_ckpt_name(_VIRTUAL, _TAG), _VIRTUAL)
        zero_names = [n for n in mem.files if n != model_name]
        rank, world = _dp_rank_and_world(engine)
        return {
            "format": FORMAT,
            "deepspeed": deepspeed.__version__,
            "zero_stage": int(engine.zero_optimization_stage()),
            "bf16": bool(engine.bfloat16_enabled()),
            "fp16": bool(engine.fp16_enabled()),
            "dp_rank": rank,
            "dp_world_size": world,
            "model_file": model_name.removeprefix(_TAG + "/"),
            "model_states": to_tree(mem.files[model_name]),
            "zero_file": zero_names[0].removeprefix(_TAG + "/") if zero_names else None,
            "zero": to_tree(mem.files[zero_names[0]]) if zero_names else None,
        }

    # ---------------------------------------------------------------- restore

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put a `state_dict` back into the engine, as ``engine.load_checkpoint`` does."""
        engine = self.engine
        sd = _checked(state_dict)
        rank, world = _dp_rank_and_world(engine)
        live = {
            "zero_stage": int(engine.zero_optimization_stage()),
            "bf16": bool(engine.bfloat16_enabled()),
            "fp16": bool(engine.fp16_enabled()),
            "dp_world_size": world,
            "dp_rank": rank,
        }
        differ = {k: (sd[k], v) for k, v in live.items() if sd[k] != v}
        if differ:
            said = ", ".join(f"{k} saved {a!r}, this engine {b!r}" for k, (a, b) in differ.items())
            raise StateMismatchError(
                f"the DeepSpeed checkpoint does not fit this engine: {said}. Start the job "
                "with the configuration that saved it"
                + (f"; {self.resumable_world_size_hint}" if "dp_world_size" in differ else "")
            )
        model = from_tree(sd["model_states"])
        zero = from_tree(sd["zero"]) if sd["zero"] is not None else None
        _check_fragments(zero)
        if engine.zero_optimization() and zero is None:
            raise CorruptCheckpointError(
                "the DeepSpeed checkpoint has no ZeRO optimizer state for this rank"
            )
        borrowed = _Borrowed((model, zero))
        before = borrowed.optimizer_states(engine)
        if engine._optimizer_has_ckpt_event_prologue():
            engine.optimizer.checkpoint_event_prologue()
        # DeepSpeedEngine._load_checkpoint, for one rank's model-states dict.
        engine.load_module_state_dict(checkpoint=model, strict=True)
        engine.loaded_checkpoint_dp_world_size = model["dp_world_size"]
        if engine.optimizer is not None and not engine.zero_optimization():
            if engine.fp16_enabled() or engine.bfloat16_enabled():
                engine.optimizer.load_state_dict(model["optimizer"], load_optimizer_states=True)
            else:
                engine.optimizer.load_state_dict(model["optimizer"])
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(model["lr_scheduler"])
        engine.global_steps = model["global_steps"]
        engine.global_samples = model.get(
            "global_samples", engine.global_steps * engine.train_batch_size()
        )
        engine.skipped_steps = model["skipped_steps"]
        engine.loaded_checkpoint_mp_world_size = model["mp_world_size"]
        # DeepSpeedEngine._load_zero_checkpoint: this rank's partition, in its place.
        if engine.zero_optimization():
            states: list[Any] = [None] * world
            states[rank] = zero["optimizer_state_dict"]  # type: ignore[index]
            engine.optimizer.load_state_dict(
                state_dict_list=states,
                load_optimizer_states=True,
                load_from_fp32_weights=engine.zero_load_from_fp32_weights(),
                checkpoint_folder=None,
                load_serial=None,
                param_shapes=engine._get_zero_param_shapes(),
            )
        if engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()
        borrowed.own(engine, before)


class _Borrowed:
    """The memory the tensors handed to `DeepSpeedState.load_state_dict` lie in (the
    storages they view: a mapped data file, a shared-memory slot, or the caller's own),
    and, after DeepSpeed's load, every tensor the engine kept in that memory made the
    engine's own.

    Where the engine keeps tensors: its base optimizers' ``state`` (what
    ``torch.optim.Optimizer.load_state_dict`` keeps by reference: a moment there is
    copied into the tensor that held it before the load, where shape and dtype agree,
    else cloned); tensors, and lists, tuples and dicts of tensors, that are attributes
    of the engine's optimizers, scheduler and loss scaler (cloned); the module's
    parameters, their ZeRO 3 partitions (``ds_tensor``) and buffers (their data
    cloned). DeepSpeed 0.19 copies everything else it is given (module weights, fp32
    partitions) and keeps only the moments; the rest is scanned so that a DeepSpeed that
    keeps more is still safe (``tests/integrations/test_deepspeed.py`` restores from
    shared memory, whose slot the next snapshot overwrites, and continues
    bit-identically)."""

    def __init__(self, trees: Any) -> None:
        spans: dict[int, int] = {}
        for t in _tensors(trees):
            if t.numel() == 0 or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            start = st.data_ptr()
            spans[start] = max(spans.get(start, 0), start + st.nbytes())
        self._spans = sorted(spans.items())

    def holds(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type != "cpu":
            return False
        at = t.data_ptr()
        return any(start <= at < end for start, end in self._spans)

    @staticmethod
    def _base_optimizers(engine: Any) -> list[torch.optim.Optimizer]:
        found: list[torch.optim.Optimizer] = []
        opt, seen = getattr(engine, "optimizer", None), set()
        while opt is not None and id(opt) not in seen:
            seen.add(id(opt))
            if isinstance(opt, torch.optim.Optimizer):
                found.append(opt)
            opt = getattr(opt, "optimizer", None)
        return found

    def optimizer_states(self, engine: Any) -> dict[tuple[int, Any], tuple[Any, torch.Tensor]]:
        """The engine's optimizer-state tensors now, by (parameter, key); each kept
        with its parameter, so that no other object takes the parameter's id."""
        return {
            (id(p), k): (p, t)
            for opt in self._base_optimizers(engine)
            for p, st in opt.state.items()
            if isinstance(st, dict)
            for k, t in st.items()
            if isinstance(t, torch.Tensor) and not self.holds(t)
        }

    def own(self, engine: Any, before: Mapping[tuple[int, Any], tuple[Any, torch.Tensor]]) -> None:
        if not self._spans:
            return
        optimizers = self._base_optimizers(engine)
        for opt in optimizers:
            for p, st in opt.state.items():
                if not isinstance(st, dict):
                    continue
                for k, t in list(st.items()):
                    if not self.holds(t):
                        continue
                    hit = before.get((id(p), k))
                    dst = hit[1] if hit is not None and hit[0] is p else None
                    if dst is not None and dst.shape == t.shape and dst.dtype == t.dtype:
                        with torch.no_grad():
                            dst.copy_(t)
                        st[k] = dst
                    else:
                        st[k] = t.detach().clone()
        holders = [engine.optimizer, *optimizers, getattr(engine, "lr_scheduler", None)]
        holders.append(getattr(engine.optimizer, "loss_scaler", None))
        for obj in holders:
            if obj is not None and hasattr(obj, "__dict__"):
                for name, value in list(vars(obj).items()):
                    owned = self._owned(value)
                    if owned is not value:
                        setattr(obj, name, owned)
        module = getattr(engine, "module", None)
        if isinstance(module, torch.nn.Module):
            for t in [*module.parameters(), *module.buffers()]:
                if self.holds(t):
                    t.data = t.data.clone()
                part = getattr(t, "ds_tensor", None)
                if part is not None and self.holds(part):
                    part.data = part.data.clone()

    def _owned(self, value: Any, depth: int = 0) -> Any:
        """``value`` with every tensor in the borrowed memory cloned (in place in lists
        and dicts; a new tuple); ``value`` itself where nothing was."""
        if isinstance(value, torch.Tensor):
            return value.detach().clone() if self.holds(value) else value
        if depth > 3:
            return value
        if isinstance(value, list):
            for i, v in enumerate(value):
                owned = self._owned(v, depth + 1)
                if owned is not v:
                    value[i] = owned
            return value
        if isinstance(value, dict):
            for k, v in list(value.items()):
                owned = self._owned(v, depth + 1)
                if owned is not v:
                    value[k] = owned
            return value
        if type(value) is tuple:
            items = tuple(self._owned(v, depth + 1) for v in value)
            return items if any(a is not b for a, b in zip(items, value)) else value
        return value


def _tensors(v: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def _checked(state_dict: Any) -> dict[str, Any]:
    """``state_dict`` as a `DeepSpeedState` tree whose every field `load_state_dict` and
    `export_deepspeed` read has its type and range; else `CorruptCheckpointError`, like a
    bad checksum, so that restore falls back to an older checkpoint before any live
    object is touched."""
    if not isinstance(state_dict, Mapping):
        raise CorruptCheckpointError(
            f"expected a DeepSpeedState tree (a dict) of format {FORMAT}, found a "
            f"{type(state_dict).__name__}"
        )
    if _int_or_none(state_dict.get("format")) != FORMAT:
        raise CorruptCheckpointError(
            f"expected a DeepSpeedState tree of format {FORMAT}, found format "
            f"{state_dict.get('format')!r}"
        )
    sd = dict(state_dict)
    _field(sd, "zero_stage", int, 0, 3)
    _field(sd, "dp_world_size", int, 1, _MAX_RANKS)
    _field(sd, "dp_rank", int, 0, sd["dp_world_size"] - 1)
    for key in ("bf16", "fp16"):
        _field(sd, key, bool)
    for key in ("model_file", "zero_file"):
        name = sd.get(key)
        if key == "zero_file" and name is None and sd.get("zero") is None:
            continue
        if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or name in (".", ".."):
            raise CorruptCheckpointError(
                f"DeepSpeedState tree: {key!r} should be a plain file name like "
                f"'mp_rank_00_model_states.pt', found {_shown(name)}"
            )
    model = sd.get("model_states")
    if not isinstance(model, Mapping):
        raise CorruptCheckpointError(
            f"DeepSpeedState tree: 'model_states' should be a dict, found {type(model).__name__}"
        )
    where = "DeepSpeedState tree: model_states"
    if not isinstance(model.get("module"), Mapping):
        raise CorruptCheckpointError(f"{where}: 'module' should be a dict of tensors")
    _field(model, "global_steps", int, 0, _MAX_INT, where=where)
    _field(model, "skipped_steps", int, 0, _MAX_INT, where=where)
    _field(model, "dp_world_size", int, 1, _MAX_RANKS, where=where)
    _field(model, "mp_world_size", int, 1, _MAX_RANKS, where=where)
    if "global_samples" in model:
        _field(model, "global_samples", int, 0, _MAX_INT, where=where)
    for key in ("lr_scheduler", "optimizer"):
        if model.get(key) is not None and not isinstance(model[key], Mapping):
            raise CorruptCheckpointError(
                f"{where}: {key!r} should be a dict or None, found {type(model[key]).__name__}"
            )
    zero = sd.get("zero")
    if zero is not None and not (
        isinstance(zero, Mapping) and isinstance(zero.get("optimizer_state_dict"), Mapping)
    ):
        raise CorruptCheckpointError(
            "DeepSpeedState tree: 'zero' should be None or a dict with an "
            f"'optimizer_state_dict' dict, found {_shown(zero)}"
        )
    return sd


def _check_fragments(zero: Any) -> None:
    """Every ``fragment_address`` of a ZeRO 1/2 partition (``param_slice_mappings``: where
    each parameter lies in this rank's fp32 partition, what ``ds_to_universal`` reads)
    lies inside that partition; else `CorruptCheckpointError`."""
    sd = zero.get("optimizer_state_dict") if isinstance(zero, Mapping) else None
    if not isinstance(sd, Mapping) or sd.get("param_slice_mappings") is None:
        return
    mappings, parts = sd["param_slice_mappings"], sd.get("single_partition_of_fp32_groups")
    if not (
        isinstance(mappings, list)
        and isinstance(parts, list)
        and len(mappings) == len(parts)
        and all(isinstance(m, Mapping) for m in mappings)
        and all(isinstance(t, torch.Tensor) for t in parts)
    ):
        raise CorruptCheckpointError(
            "DeepSpeedState tree: 'param_slice_mappings' should be one dict per fp32 "
            "partition in 'single_partition_of_fp32_groups'"
        )
    for group, (mapping, part) in enumerate(zip(mappings, parts)):
        for name, frag in mapping.items():
            if not isinstance(frag, fragment_address) or frag.start + frag.numel > part.numel():
                raise CorruptCheckpointError(
                    f"DeepSpeedState tree: the fragment of {str(name)[:80]!r} in group {group} "
                    f"({_shown(frag)}) does not lie in that group's fp32 partition of "
                    f"{part.numel()} elements"
                )


_MAX_INT = 2**63 - 1
"""Counters, element counts and offsets are int64 in torch: a larger one is corrupt."""
_MAX_RANKS = 2**31 - 1
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def _shown(value: Any) -> str:
    """``value`` for a message: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _field(
    node: Mapping[str, Any],
    key: str,
    kind: type,
    lo: float | None = None,
    hi: float | None = None,
    *,
    where: str = "DeepSpeedState tree",
) -> None:
    """Raise `CorruptCheckpointError` unless ``node[key]`` is a ``kind`` (exactly: a
    bool is no int, an int is a float) within ``[lo, hi]``, finite."""
    value = node.get(key, _MISSING)
    _check_value(value, kind, lo, hi, f"{where}: {key!r}")


_MISSING = object()


def _check_value(value: Any, kind: type, lo: float | None, hi: float | None, what: str) -> None:
    if value is _MISSING:
        raise CorruptCheckpointError(f"{what} is missing")
    if kind is float:  # an int too, if a float can hold it
        ok = (type(value) is float and math.isfinite(value)) or (
            type(value) is int and abs(value) <= 2**1023
        )
    else:
        ok = type(value) is kind
    if ok and lo is not None and value < lo:
        ok = False
    if ok and hi is not None and value > hi:
        ok = False
    if not ok:
        expected = {int: "an integer", float: "a finite number", bool: "true or false"}.get(
            kind, kind.__name__
        )
        span = ""
        if lo is not None or hi is not None:
            span = f" in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise CorruptCheckpointError(f"{what} should be {expected}{span}, found {_shown(value)}")


def state_sha256(engine: Any) -> str:
    """sha256 of every rank's whole engine state, as `DeepSpeedState` takes it: module,
    ZeRO partition (fp32 masters, moments), scheduler, counters. Collective: every rank
    calls it and gets the same digest. For checking that a resumed run ends exactly as
    an uninterrupted one (the examples' and tests' result line)."""
    import hashlib

    h = hashlib.sha256()

    def walk(v: Any) -> None:
        if isinstance(v, Mapping):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous().reshape(-1)
            h.update(str(t.dtype).encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(v, (int, float, str, bool)) or v is None:
            h.update(repr(v).encode())

    sd = DeepSpeedState(engine).state_dict()
    walk({k: v for k, v in sd.items() if k in ("model_states", "zero")})
    if not torch.distributed.is_initialized():
        return h.hexdigest()
    digests: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(digests, h.hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()


# ------------------------------------------------------------------ the codec


def to_tree(v: Any) -> Any:
    """``v`` with the DeepSpeed objects it holds replaced by tagged plain values; what the
    `Checkpointer` stores as it is (dicts, lists, tuples, tensors, JSON values) is kept."""
    if isinstance(v, enum.Enum) and type(v).__name__ in _ENUMS:
        return {TAG_KEY: "enum", "class": type(v).__name__, "value": v.value}
    if isinstance(v, fragment_address):
        return {TAG_KEY: "fragment_address", "numel": int(v.numel), "start": int(v.start)}
    if isinstance(v, torch.Size):  # param_shapes: zero_to_fp32 calls their .numel()
        return {TAG_KEY: "size", "dims": [int(d) for d in v]}
    if type(v).__name__ in _SCALERS and isinstance(v, _SCALERS[type(v).__name__]):
        attrs = {k: a for k, a in vars(v).items() if isinstance(a, _PLAIN_ATTRS)}
        unknown = sorted(set(attrs) - set(_SCALER_ATTRS[type(v).__name__]))
        if unknown:  # a newer DeepSpeed: refused now rather than restored without them
            raise UnsupportedStateError(
                f"DeepSpeed's {type(v).__name__} has attribute(s) {unknown} that "
                "resumable's DeepSpeed codec does not know (written by another DeepSpeed "
                f"than {deepspeed.__version__}?); it would not restore them. Use the "
                "DeepSpeed version resumable was tested with (docs/deepspeed.md)"
            )
        return {TAG_KEY: "loss_scaler", "class": type(v).__name__, "attrs": attrs}
    if isinstance(v, Mapping):
        return {k: to_tree(x) for k, x in v.items()}
    if isinstance(v, list):
        return [to_tree(x) for x in v]
    if isinstance(v, tuple) and not hasattr(v, "_fields") and type(v) is tuple:
        return tuple(to_tree(x) for x in v)
    return v


def from_tree(v: Any) -> Any:
    """The inverse of `to_tree`: tagged nodes become their DeepSpeed objects again, built
    from an allow-list of classes and plain attribute values only."""
    if isinstance(v, Mapping):
        tag = v.get(TAG_KEY)
        if tag is None:
            return {k: from_tree(x) for k, x in v.items()}
        return _rebuild(tag, v)
    if isinstance(v, list):
        return [from_tree(x) for x in v]
    if isinstance(v, tuple):
        return tuple(from_tree(x) for x in v)
    return v


def _rebuild(tag: Any, node: Mapping[str, Any]) -> Any:
    """The DeepSpeed object a tagged node stands for, every field checked for its type
    and range first; a bad node is a `CorruptCheckpointError` naming what was wrong."""
    fields = (
        {
            "enum": {"class", "value"},
            "fragment_address": {"numel", "start"},
            "size": {"dims"},
            "loss_scaler": {"class", "attrs"},
        }.get(tag)
        if isinstance(tag, str)
        else None
    )
    if fields is None:
        raise CorruptCheckpointError(
            f"DeepSpeedState tree: unknown tagged node {_shown(tag)}; expected one of "
            "'enum', 'fragment_address', 'size', 'loss_scaler'"
        )
    where = f"DeepSpeedState tree: bad {tag!r} node"
    if set(node) != fields | {TAG_KEY}:
        raise CorruptCheckpointError(
            f"{where}: expected the fields {sorted(fields)}, found {sorted(map(str, node))}"
        )
    if tag == "enum":
        cls = _ENUMS.get(node["class"]) if isinstance(node["class"], str) else None
        if cls is None:
            raise CorruptCheckpointError(
                f"{where}: class should be one of {sorted(_ENUMS)}, found {_shown(node['class'])}"
            )
        members = [m.value for m in cls]
        if type(node["value"]) is not int or node["value"] not in members:
            raise CorruptCheckpointError(
                f"{where}: a {cls.__name__} value should be one of {members}, found "
                f"{_shown(node['value'])}"
            )
        return cls(node["value"])
    if tag == "fragment_address":
        _check_value(node["numel"], int, 0, _MAX_INT, f"{where}: numel")
        _check_value(node["start"], int, 0, _MAX_INT - node["numel"], f"{where}: start")
        return fragment_address(numel=node["numel"], start=node["start"])
    if tag == "size":
        dims = node["dims"]
        if not isinstance(dims, list) or len(dims) > _MAX_DIMS:
            raise CorruptCheckpointError(
                f"{where}: dims should be a list of at most {_MAX_DIMS} sizes, found {_shown(dims)}"
            )
        for d in dims:
            _check_value(d, int, 0, _MAX_INT, f"{where}: a dimension")
        if math.prod(dims) > _MAX_INT:
            raise CorruptCheckpointError(f"{where}: dims {dims} hold more than 2**63 - 1 elements")
        return torch.Size(dims)
    cls_name = node["class"]
    allowed = _SCALER_ATTRS.get(cls_name) if isinstance(cls_name, str) else None
    if allowed is None or cls_name not in _SCALERS:
        raise CorruptCheckpointError(
            f"{where}: class should be one of {sorted(_SCALERS)}, found {_shown(cls_name)}"
        )
    attrs = node["attrs"]
    if not isinstance(attrs, Mapping):
        raise CorruptCheckpointError(f"{where}: attrs should be a dict, found {_shown(attrs)}")
    unknown = sorted(str(k) for k in attrs if k not in allowed)
    if unknown:
        raise CorruptCheckpointError(
            f"{where}: a {cls_name} has no attribute(s) {unknown} to restore; allowed: "
            f"{sorted(allowed)}"
        )
    values: dict[str, Any] = {}
    for name, (kind, lo, hi, default) in allowed.items():
        if name not in attrs and default is not None:
            values[name] = default
            continue
        what = f"{where}: {cls_name}.{name}"
        if kind is torch.dtype:
            if not any(attrs.get(name) is d for d in _SCALE_DTYPES):
                raise CorruptCheckpointError(
                    f"{what} should be one of {[str(d) for d in _SCALE_DTYPES]}, found "
                    f"{_shown(attrs.get(name))}"
                )
        else:
            _check_value(attrs.get(name, _MISSING), kind, lo, hi, what)
        values[name] = attrs[name]
    if values["cur_scale"] <= 0 or values.get("scale_factor", 1.0) <= 0:
        raise CorruptCheckpointError(f"{where}: the loss scale and its factor must be positive")
    if values["dynamic"] != (cls_name == "DynamicLossScaler"):
        raise CorruptCheckpointError(
            f"{where}: a {cls_name} has dynamic={cls_name == 'DynamicLossScaler'}, found "
            f"{values['dynamic']!r}"
        )
    cls = _SCALERS[cls_name]
    obj = cls.__new__(cls)
    obj.__dict__.update(values)
    return obj


_MAX_DIMS = 64


# ---------------------------------------------------------------- export


def export_deepspeed(
    url: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    key: str = "engine",
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write a committed checkpoint's `DeepSpeedState` in DeepSpeed's own layout.

    ``out_dir`` gets ``global_step<N>/`` with the model-states and ZeRO files every rank
    wrote (what ``engine.save_checkpoint`` makes), DeepSpeed's ``zero_to_fp32.py`` and a
    ``latest`` file, so that ``engine.load_checkpoint(out_dir)``, ``zero_to_fp32`` and
    ``ds_to_universal`` take it. Runs in one process, without DeepSpeed's engine; every
    tensor is read and checksummed. Returns the tag directory written.

    Args:
        url: the checkpoint root (as given to the `Checkpointer`).
        step: the step to export (default: the newest committed one).
        key: the state key the `DeepSpeedState` was saved under.
        storage_options: for an object-store root, what the `Checkpointer` was given
            (``endpoint_url``, credentials, ...).

    Raises:
        NoCheckpointError: nothing is committed in ``url`` (or not ``step``).
        CorruptCheckpointError: the checkpoint fails its checks.
    """
    from resumable import capture as capture_mod
    from resumable.commit import list_committed
    from resumable.reader import CheckpointReader
    from resumable.storage import open_storage

    storage = open_storage(url, storage_options)
    steps = list_committed(storage)
    if step is None and not steps:
        raise NoCheckpointError(
            f"no committed checkpoint in {storage.url} to export; check the root (the "
            "Checkpointer's url) and that a save of the job committed"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise NoCheckpointError(
            f"no committed checkpoint for step {step} in {storage.url}; committed steps: "
            f"{steps[-10:]}"
        )
    reader = CheckpointReader(storage, step)
    ranks = reader.manifest["ranks"]
    per_rank: list[dict[str, Any]] = []
    for r, rank in enumerate(ranks):
        node = dict((k, n) for k, n in rank["tree"].get("dict", [])).get(key)
        if node is None:
            raise StateMismatchError(
                f"{reader.where}: rank {r} saved no {key!r} key; pass key= the state key of "
                "the DeepSpeedState"
            )
        tree = {"dict": [[key, node]]}
        names = [n for _, n in capture_mod.iter_tensor_refs(tree)]
        # The module of ZeRO 0-2 is written once per job (`resumable_replicated`): its
        # tensors are global nodes, each stored whole under its name by one rank.
        names = list(dict.fromkeys([*names, *capture_mod.global_refs(tree)]))
        got = reader.tensors(names, verify=True)
        values = capture_mod.decode(tree, got, "cpu", resolve=got.__getitem__)
        per_rank.append(_checked(values[key]))
    # Every rank's files rebuilt (and so checked) before anything is written.
    files: dict[str, Any] = {}
    for sd in per_rank:
        for name, tree_value in (
            (sd["model_file"], sd["model_states"]),
            (sd["zero_file"], sd["zero"]),
        ):
            # ZeRO 0-2: every rank kept the model states; rank 0's go.
            if tree_value is not None and name not in files:
                files[name] = from_tree(tree_value)
                if tree_value is sd["zero"]:
                    _check_fragments(files[name])
    tag = f"global_step{per_rank[0]['model_states']['global_steps']}"
    out = os.path.join(os.fspath(out_dir), tag)
    os.makedirs(out, exist_ok=True)
    for name, value in files.items():
        torch.save(value, os.path.join(out, name))
    script = os.path.join(os.path.dirname(deepspeed.__file__), "utils", "zero_to_fp32.py")
    if os.path.isfile(script):
        shutil.copyfile(script, os.path.join(out_dir, "zero_to_fp32.py"))
    with open(os.path.join(out_dir, "latest"), "w") as f:
        f.write(tag)
    return out
